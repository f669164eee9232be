"""What every part of hpcpipe uses and nothing of hpcpipe's own: the error types and exit
codes (`errors`), atomic writes and the output paths a command may claim (`files`), what
values from outside must look like (`schema`), how text from outside is shown on a
terminal (`terminal`), argument checks (`arguments`), the colours of every picture
(`colours`) and a rank's timeline events and per-step statistics (`timeline`).

May import: nothing of hpcpipe (the standard library and NumPy only).
"""
