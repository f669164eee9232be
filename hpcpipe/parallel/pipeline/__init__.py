"""Pipeline parallelism: tagged stage-to-stage messages (`p2p`), one rank's op list run as
computation and messages (`runtime`), the stages a rank holds (`stages`: those the run's
plan hands it, hpcpipe/plan) and the tied embedding's gradient exchange (`tied`)."""
