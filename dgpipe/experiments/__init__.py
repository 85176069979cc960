"""The experiment harness: the quality benchmark of boundary settings over paired seeds (:mod:`.ablation`), its plot
(:mod:`.plots`), its named settings (:mod:`.settings`) and the language-model benchmarks' report
(:mod:`.lm_benchmark`). They run the main jobs as subprocesses and read their logs; the scripts in
``benchmarks/`` call them.
"""
