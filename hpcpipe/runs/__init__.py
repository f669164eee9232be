"""A run directory and what it says about the run: the folder itself (`rundir`), a run in
pieces across resumes (`pieces`), what a piece leaves behind — summary, traces, timeline
pictures (`record`) —, step records and progress lines (`metrics`), the end-of-run summary
(`report`), trace.json and the timeline PNGs (`trace`) and `plot`; and the [train]
section (`section`: the run's steps, optimizer, outer loop, evaluation and logging).

May import: `checkpoint`, `data`, and everything below them. Never `config` or `train`
(it is handed sections and values, never the whole Config).
"""
