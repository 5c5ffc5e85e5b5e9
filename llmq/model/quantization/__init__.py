"""Weight-only quantization as transforms on a built model: decoder projections swapped for
QuantizedLinear modules, either quantized at load (int8, int4) or read from a GPTQ / AWQ checkpoint."""
