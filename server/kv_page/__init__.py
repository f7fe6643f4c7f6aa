"""The live KV page: ``/kv`` (HTML/CSS/JS from ``static/``), ``/kv/state`` (JSON) and
``/kv/events`` (SSE); see :mod:`server.kv_page.routes` and :mod:`server.kv_page.state`."""
