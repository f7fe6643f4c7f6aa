"""Tool calling on ``/v1/chat/completions``.

``formats``: the tool-call output formats (``hermes``, ``llama3_json``, ``mistral``; vLLM's
parser names), how a call looks in the model's text, and which format a chat template implies.
``request``: a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` validated into a
``ToolSet``.
``prompt``: the conversation as the chat template gets it (the template's own ``tools``
support, else kvserve's documented default preamble). ``constraint``: the xgrammar structural
tag that constrains the calls. ``parser``: finished or streamed text back into OpenAI's
``tool_calls``.
"""
