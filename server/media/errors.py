"""``MediaError``: why an image a request refers to cannot be used."""

from __future__ import annotations


class MediaError(ValueError):
    """A refused image: ``status`` is the HTTP status to answer (400, or 413 when something is
    over a size limit), ``message`` says what is wrong, ``field`` names the request's field
    (dotted, as the API names it) once the caller knows it (None until then)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.status = status
        self.message = message
        self.field = field

    def at(self, field: str) -> MediaError:
        """This error, naming ``field`` (one that names a field already keeps it)."""
        if self.field is not None:
            return self
        return MediaError(self.status, self.message, field)
