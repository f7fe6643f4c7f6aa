"""The Responses API (``/v1/responses``), served by the chat machinery.

``request``: the body, and its translation into a chat request. ``items``: input items read
and normalised, items as chat messages, outputs as output items. ``writer``: the response
object, whole or as typed stream events. ``store``: stored responses (bounded, in memory) for
``previous_response_id``, ``GET`` and ``DELETE``. ``endpoint``: the routes.
"""
