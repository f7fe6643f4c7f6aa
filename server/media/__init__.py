"""Images in requests, at the API's edge: where an image may come from (``limits.py``:
``MediaSettings``), how its bytes are read (``sources.py``: ``data:``, ``file://`` and allowed
``http(s)://`` URLs), the images of a request found and decoded in each API's shape
(``collect.py``), the refusal of images by a model that takes none (``gate.py``), and the one
call a route makes (``check.py``). Every refusal is a ``MediaError`` (``errors.py``) with an
HTTP status; the route turns it into its API's error, naming the field.
"""
