"""What starting (or restarting) a tritonserver can fail with."""


class ServerError(RuntimeError):
    """The server exited or never became ready; the message holds its own error lines."""


class NotReady(ServerError):
    """The server did not become ready in time (it was killed); the message says where it stood."""



class Aborted(ServerError):
    """The server died of a signal while starting: python_backend r24.10 aborts now and then with
    boost's `lock_exception` when it starts on a busy machine beside other servers (server issue
    8882), a crash a new start does not repeat."""
