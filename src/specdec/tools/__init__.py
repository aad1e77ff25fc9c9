"""The tools built on the library: training (corpora, distilled drafts, EAGLE heads),
benchmark (`specdec bench`, llama.cpp side by side) and the demo. They import the library;
the library never imports them (the command line, at the top, reaches them)."""
