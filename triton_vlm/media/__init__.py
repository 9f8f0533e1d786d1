"""Media into what the vision tower and the decoder read: request items into bytes and images
(`images`) and videos into frames (`videos`, PyAV), frames sized (`sizing`) and laid out as
`pixel_values` rows (`frames`), 3-D rotary positions of a prompt (`mrope`), EVS video-token
pruning (`evs`), and synthetic media made here for the demo, tests and benchmarks (`samples`).
The families' processor rules are written with these; nothing here names a family.
"""
