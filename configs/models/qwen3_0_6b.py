"""Model layer: Qwen3-0.6B (`Qwen/Qwen3-0.6B`) and its precision and memory knobs."""


def get_model():
    return dict(
        preset="qwen3-0.6b",  # the architecture (fixed); training loads the weights of --config.model.hf_path
        param_dtype="float32",  # master weights: lr 1e-6 updates vanish in bfloat16
        compute_dtype="bfloat16",
        ref_dtype="bfloat16",  # the frozen teacher/reference: half the memory
        remat=True,
        attn_q_chunk=1024,
    )
