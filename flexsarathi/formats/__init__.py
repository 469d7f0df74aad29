"""Reading users' files: safetensors, pre-quantized (GPTQ/AWQ/compressed-tensors) and GGUF
checkpoints, dummy weights, tokenizers and hub names, opened once per job (opened_model.py). Model
families' math lives in flexsarathi/models/; these modules hand it weights in its canonical names."""
