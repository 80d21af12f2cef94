"""The scaffold generator behind ``resin new-model``: HF config -> ``models/NAME/``.

Owns turning an HF checkpoint (or just its ``config.json``) into a model directory Resin can
drive: :mod:`.inspect` builds the HF model on the ``meta`` device and records its real module
tree (classes, source locations, parameter names and shapes, per-layer types, MoE / MTP / rope
settings); :mod:`.layer_map` maps layers to ``LayerCacheSpec`` and HF classes to the blocks
Resin already has; :mod:`.render` renders ``templates/model/*.j2`` into the output directory;
:mod:`.tiny_checkpoint` writes a tiny random-weight checkpoint of the same architecture;
:mod:`.runtime` is what generated runners call at run time (checkpoint inspection, weight
loading with shape checks, the per-layer context blocks receive); :mod:`.cli` is the typer
command. Importing this package loads neither torch nor transformers.
"""
