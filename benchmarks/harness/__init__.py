"""specli's benchmark harness: the shared parts (models, prompt sets, native llama.cpp, cost
tables, replays, interleaved rounds, tables and JSON) behind `benchmarks/bench.py`'s entry
points. benchmarks/README.md says which entry point answers which question."""
