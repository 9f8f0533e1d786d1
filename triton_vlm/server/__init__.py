"""tritonserver itself: starting and stopping the bundled server (`tritonserver`), keeping it
serving while it runs (`supervisor`: a dead stub's model is reloaded), its Python-backend stub
processes (`stubs`; `stub_watch` ends a stub with its server), and its admin APIs closed to clients
without the operator's key (`admin`).
"""
