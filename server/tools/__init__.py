"""Tool calling on ``/v1/chat/completions``.

``formats``: the tool-call output formats (``hermes``, ``llama3_json``, ``mistral``,
``qwen3_coder``, ``deepseek_v3``, ``deepseek_v31``, ``openai``; vLLM's parser names), how a
call looks in the model's text, and which format a chat template implies; ``base`` what a
format is; ``qwen3_coder``, ``deepseek`` and ``harmony`` one format (family) each.
``request``: a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` validated into a
``ToolSet``.
``prompt``: the conversation as the chat template gets it (the template's own ``tools``
support, else kvserve's documented default preamble). ``constraint``: the xgrammar structural
tag that constrains the calls. ``parser``: finished or streamed text back into OpenAI's
``tool_calls`` (incrementally: arguments as they are written, a call cut short as far as it
was written); ``partial``: reading a call's head and arguments while it is written.
"""
