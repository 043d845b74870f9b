"""The RoPE core: how a method config becomes hooks on a transformers model, and comes off again.

    rescaling        rescale / unrescale / rescaled and the Ms-PoE read-outs; applies a method
                     with the hooks its config declares
    architectures    every per-architecture fact, in one table (ARCHITECTURES)
    hooks            what all hooks share (RoPE or not): per-forward facts, clean removal
    rotary_scaling   hooks of the RoPE methods (and compositions); RopeScaling, their base config
    uniform          the uniform method (position interpolation)
    layerwise        the layer-wise method
    mspoe            the Ms-PoE method
    layer_tables     per-layer cos/sin tables at position / factor, cached per forward
    head_rotation    Ms-PoE: head ranks, each head rotated at its ratio, the wrapped apply_rotary
    awareness        the position-awareness score (Ms-PoE Eq. 1) and the head ranking it gives
    bezier           Bezier curves over layer index, for layer-wise factors
    variants         transformers' own RoPE types (dynamic NTK, YaRN) as model variants

Methods that do not touch RoPE live outside this package (`rag_mspoe.methods.hidden_scaling`).
"""
