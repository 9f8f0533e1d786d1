"""The one error type a request can fail with: Triton turns it into INVALID_ARG."""
from __future__ import annotations


class InvalidInput(ValueError):
    """A request the server cannot serve as asked.

    The message names the input and the limit (`images[1]: not a decodable image`,
    `videos[0]: 9000 frames exceed max_frames=768`) and never carries internal details
    (paths, addresses, library tracebacks): it is shown to the client as is.
    """
