"""DeepSeek-V4 (HF's DeepseekV4ForCausalLM), one concept per module.

config.py (V4Arch: the config, validated), rope.py (the two rotary tables), norm.py (RMS norms
as HF V4 computes them), compressor.py (CSA/HCA compressors and the lightning indexer, over a
sequence's KV state), attention.py (sliding window plus compressed entries, sinks, grouped
output), hyper.py (manifold-constrained hyper-connections and the head's collapse), moe.py
(routers, experts), model.py (the decoder). kv.py: the KV seam's protocols (from
attention/step_kv.py, which the engine implements) and plain-tensor KV for the tests.

Nothing is imported here: model/config.py imports config.py while model.py imports ModelArch.
"""
