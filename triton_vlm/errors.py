"""The one error type a request can fail with (Triton turns it into INVALID_ARG), and how a refusal
for now (UNAVAILABLE: an overload, a step being restarted) is worded and told by its words."""
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


# A caller that gets an error without its code (a gRPC stream; a BLS caller in Triton 2.51 gets
# INTERNAL, whatever the code) tells refusals for now (Triton's queue policy, the llm's queue
# timeout, a step that died or is being reloaded: `triton_vlm.serving.pipeline.restarted`) by their
# messages.
RESTARTED = "step restarted; retry"
REFUSALS = ("Request timeout expired", "Exceeds maximum queue size", BUSY_PREFIX, RESTARTED)
