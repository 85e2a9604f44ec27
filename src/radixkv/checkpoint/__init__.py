"""A checkpoint's files, read without loading a model: where they come from
(`radixkv.checkpoint.sources`) and reading them with bounds a hostile folder cannot pass
(`radixkv.checkpoint.files`). The tokenizers, the engine and the simulator read folders
through it; it imports nothing else of radixkv.

Owns: finding and reading a checkpoint's files. Must not touch: what they mean (the
tokenizers and the engine's loader decide), torch.
"""
