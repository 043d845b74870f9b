"""The RoPE core: how a method config becomes hooks on a transformers model, and comes off again.

    rescaling        rescale / unrescale / rescaled and the Ms-PoE read-outs; picks the hooks
                     of a method by its kind
    architectures    every per-architecture fact, in one table (ARCHITECTURES)
    hooks            what all hooks share: per-forward facts from the decoder, clean removal
    rotary_scaling   hooks of uniform, layer-wise and Ms-PoE scaling (and compositions)
    layer_tables     per-layer cos/sin tables at position / factor, cached per forward
    head_rotation    Ms-PoE: head ranks, each head rotated at its ratio, the wrapped apply_rotary
    awareness        the position-awareness score (Ms-PoE Eq. 1) and the head ranking it gives
    hidden_scaling   hooks of positional hidden-state scaling
    bezier           Bezier curves over layer index, for layer-wise factors
    variants         transformers' own RoPE types (dynamic NTK, YaRN) as model variants

Nothing is imported here, so `rag_mspoe.methods` can use `bezier` without loading the hooks.
"""
