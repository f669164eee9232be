"""Pipeline parallelism: tagged stage-to-stage messages (`p2p`), one rank's op list run as
computation and messages (`runtime`), the stages a rank holds (`stages`), the tied
embedding's gradient exchange (`tied`), which blocks each stage holds (`partition`) and the
schedule a run plans from its config and measured costs (`planning`)."""
