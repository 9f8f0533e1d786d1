"""What a decoder is made of: its layer classes (`decoder`: RMSNorm and the text architectures'
layers), rotary positions (`rotary`), mixture-of-experts MLPs (`moe`), Gated DeltaNet linear
attention (`linear_attention`), the CUDA elementwise kernels (`cuda_ops`), and `spec.DecoderSpec`,
the data a family's decoder is (its folder's `decoder.py` holds its specs).
"""
