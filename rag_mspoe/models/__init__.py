"""Getting a model onto a device: where it comes from, how it is cached, placed and quantized.

loading          load_model: the embedded default, a local folder, a hub id or a GGUF file
embedded_models  the models shipped as packages (SmolLM2-135M, Qwen2.5-Coder-0.5B), offline
model_cache      the converted copies under ~/.cache/rag_mspoe; ModelLoadError
devices          resolve_device, resolve_dtype, place; DeviceError
quantization     opt-in int4/int8 weights and an int8 prompt read for CPU inference
command_options  the command-line options of every command that loads a model
"""
