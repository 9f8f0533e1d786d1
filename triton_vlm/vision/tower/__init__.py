"""What the family towers are made of: the `Tower` class the encoders, the exporter and the
TensorRT builder see (`base`), its settings and strict weight loading (`config`), host-side group
metadata and rotary tables (`attention_groups`), the shared torch layers (`layers`, `siglip`), the
embedding rows of each grid row (`rows`, numpy only) and TensorRT profile shapes (`trt_profile`).
Each family folder's tower subclasses `base.Tower`; nothing here names a family.
"""
