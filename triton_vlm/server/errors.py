"""What starting (or restarting) a tritonserver can fail with."""


class ServerError(RuntimeError):
    """The server exited or never became ready; the message holds its own error lines."""


class NotReady(ServerError):
    """The server did not become ready in time (it was killed); the message says where it stood."""

