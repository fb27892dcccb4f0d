"""``moeplug plan``: a performance and memory model of Megatron-style MoE training.

Small modules, one job each: :mod:`cluster` (hardware entries, "this CPU" measured),
:mod:`models` (model configs beyond the presets, and the published rows the model is checked
against), :mod:`memory` (per-rank bytes), :mod:`perf` (step time, TFLOP/s, MFU), :mod:`search`
(valid mappings under the memory limit), :mod:`report` (table + PNG), :mod:`cli`.
"""
