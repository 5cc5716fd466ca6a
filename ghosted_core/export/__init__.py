"""Export: a variant saved as a folder others can load, zipped or pushed to the Hub.

- `folder`: save a variant as a stock or remote-code Hugging Face folder; zip, check, load, upload.
- `fold`: a variant's weights as a stock state dict (ReplaceMe folded into down_proj) or as its own tree.
- `checkpoint`: offload-aware tensor reading, safetensors shards, a clean config.json.
- `model_card`: the export's README.md and the run facts it states.
- `gguf`: a stock export converted to GGUF by llama.cpp's own converter, quantized to the offered types.
- `llamacpp`: llama.cpp's own tools on a GGUF: generation, perplexity, speed, quantization, importance matrix.
- `runtime_rules`: what llama.cpp reads off the block count instead of the file, and what a cut's GGUF writes for it.
- `gain`: what pruning buys: each variant's size as it would be saved, and its speed in transformers, against dense.
"""
