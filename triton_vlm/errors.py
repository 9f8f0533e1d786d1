"""The one error type a request can fail with (Triton turns it into INVALID_ARG), and how an overload
refusal (UNAVAILABLE) is worded."""
from __future__ import annotations


class InvalidInput(ValueError):
    """A request the server cannot serve as asked.

    The message names the input and the limit (`images[1]: not a decodable image`,
    `videos[0]: 9000 frames exceed max_frames=768`) and never carries internal details
    (paths, addresses, library tracebacks): it is shown to the client as is.
    """


# Every overload refusal of ours starts with this, so that a caller that only sees the message (a BLS
# caller in Triton 2.51, a gRPC stream) can tell it: `busy("...")`.
BUSY_PREFIX = "server busy: "


def busy(reason: str) -> str:
    """The message of an overload refusal: `server busy: <reason>; retry later`."""
    return f"{BUSY_PREFIX}{reason}; retry later"
