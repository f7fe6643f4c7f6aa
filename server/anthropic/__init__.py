"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Served by the chat machinery (server.chat.chat_prompt: template, tools, constraints, the
reasoning split), like the Responses API: ``request`` turns an Anthropic body into a
``/v1/chat/completions`` body; ``writer`` writes the engine's outputs as Anthropic's message
object and its typed event stream; ``errors`` gives every failure on these paths Anthropic's
error shape and accepts ``x-api-key``; ``endpoint`` holds the routes. docs/anthropic.md is the
user's page.
"""
