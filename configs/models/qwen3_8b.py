"""Model layer: Qwen3-8B (the post-trained `Qwen/Qwen3-8B`; docs/spec.md §2) and its precision and memory knobs."""


def get_model():
    return dict(
        preset="qwen3-8b",  # the architecture (fixed); training loads the weights of --config.model.hf_path
        param_dtype="float32",  # master weights: lr 1e-6 updates vanish in bfloat16
        compute_dtype="bfloat16",
        ref_dtype="bfloat16",  # the frozen teacher/reference: half the memory
        remat=True,
        attn_q_chunk=1024,
    )
