"""The workbench for fusion-rule research (docs/workbench.md):

* ``explore`` (explore.py): the effect of new rules, or of removing library rules, on a
  corpus of programs (``corpus.py``: the built-in corpus and programs read from files);
* ``show`` (show.py, svg.py): one derivation as a self-contained HTML page;
* ``bench`` (bench.py, plots.py): the GPU benchmark suite, its tables and plots.
"""
