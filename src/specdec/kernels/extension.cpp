// The extension's one translation unit: the three sources compiled as one, so that PyTorch's
// headers (torch/python.h: 16 s of a source's compile on a 2-core Sapphire Rapids) are parsed once,
// not once per source: 32 s of compiler time for a variant against 60 s as three (about the same
// wall time on two cores, where ninja ran them side by side; docs/runner.md, "Build time").
// Each file still owns its part: qmatmul.cpp the quantized products and the module, attention.cpp
// the attention over the cache, layer.cpp a decoder layer's forward; their file-local names
// live in one anonymous namespace here, so they must not repeat one another.
#include "qmatmul.cpp"
#include "attention.cpp"
#include "layer.cpp"
