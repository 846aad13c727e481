"""The jobs: what a command does, as functions over the layers below (nothing below a job imports a job).

- ``quantize``: the main job (``qcore quantize``, ``quantize_and_report``): a frozen ``QuantizeJob`` checked into
  a ``QuantizePlan`` (``check``: every check, no work) and ``run`` in phases (baseline, quantize, measure,
  export, report);
- ``imatrix``: ``qcore imatrix`` (``imatrix_file``);
- ``convert``: ``qcore convert`` (``convert``: any quantized checkpoint into another format, compared back);
- ``checkpoint``: ``quantize_checkpoint`` (a checkpoint larger than memory, one decoder layer at a time);
- ``scheme`` and ``report``: the main job's scheme resolution and its report;
- ``common``: what they share (the model loader, the text, how errors name options).

Each job is imported from its module (``from qcore.adapters.jobs.convert import convert``); ``qcore.adapters``
re-exports the main job's ``quantize_and_report``, ``QuantizeJob`` and ``QuantizeReport``.
"""
