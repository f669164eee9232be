"""HDF5 checkpoints: atomic, verified, exact to resume, loadable under any layout.

Owns: writing (`save`), finding and checking (`verify`), loading (`load`), whole models
in and out (`weights`, `safetensors`), the manifest (`manifest`), `latest` and rotation
(`retention`), how a part's state sits in its files (`parts`) and how arrays sit in the
HDF5 files (`hdf5`). It never reaches into a rank: it is handed the rank's stateful
parts (util/state.py: the parameters, the optimizer shards, PowerSGD's state, the outer
loop's, the asynchronous pipeline's weight versions — each a class beside its own code)
and their layout, and writes and reads what they say they hold. May import: `model` (for
the shape of a tensor's parts), `device`, `util`; never `config`: it is handed the
config's TOML and model shape (`Origin`), and owns its own section ([checkpoint]:
`section`).

Layout of one checkpoint (h5py is serial HDF5, so ranks write their own files):

    RUN_DIR/checkpoints/
        latest                        "step_00000120": replaced atomically, last of all
        step_00000120/
            model-pp000.h5            parameters of pipeline rank 0's stages, written by its
            model-pp001.h5            first replica, under GPT-2's names and global shapes
            optim-r00000.h5           optimizer state this rank holds (all of a stage's, or
                                      with ZeRO its shard), in segments of flattened tensors
            local-r00000.h5, powersgd-r00000.h5, versions-pp000.h5
                                      the other parts a run has, one file per rank or per
                                      pipeline rank
            manifest.json             written last, by rank 0: step, config, layout, run, the
                                      files of each part, and per file its size and SHA-256;
                                      no manifest, no checkpoint
            manifest.sha256           the manifest's own SHA-256 (see manifest.py)

Every file records its part, step and rank (parts.py), so a file copied in from another
step or swapped between ranks is refused by name, and state the manifest says the run had
and that is missing is refused. Checkpoints written before those records (format 2) still
load: their files are taken on their manifest's word, as they were when written.

Every file goes through a temporary name → flush → fsync → rename → fsync of the folder
(files.write_atomic), and a checkpoint is assembled in a hidden temporary folder that is renamed into place
only once every file and the manifest are complete, so a crash or a kill at any moment
leaves the previous checkpoint as it was. `latest` moves only to a checkpoint that
verifies, and rotation deletes only older checkpoints of the same run (retention.py).

Parameters are stored whole, one dataset per GPT-2 name, with the fletcher32 checksum;
`h5ls -r model-pp000.h5` reads like a GPT-2 state dict. bfloat16 arrays are stored as
uint16 with a `dtype` attribute. Optimizer state (Adam's exp_avg and exp_avg_sq, and
float32 master weights under 16-bit compute) is stored as segments [start, stop) of each
flattened tensor, so a checkpoint written by any (dp, pp, ZeRO) layout can be read by any
other: each rank reads only the tensors and slices it needs. Nothing random needs saving:
data sampling and initialisation are counter-based, keyed by (seed, step, sample index).
"""

from hpcpipe.checkpoint.hdf5 import sha256
from hpcpipe.checkpoint.load import load
from hpcpipe.checkpoint.manifest import CheckpointError
from hpcpipe.checkpoint.manifest import model_shape as manifest_shape
from hpcpipe.checkpoint.manifest import read as read_manifest
from hpcpipe.checkpoint.retention import (
           latest,
           list_checkpoints,
           root_of,
           step_name,
)
from hpcpipe.checkpoint.save import Carried, Origin, Saved, new_run_id, save
from hpcpipe.checkpoint.verify import (
           check_model,
           find_usable,
           is_checkpoint,
           resolve,
           verify,
)
from hpcpipe.checkpoint.weights import (
           TOKENIZER,
           load_model,
           read_weights,
           tokenizer_file,
           write_weights,
)

__all__ = ["Carried", "CheckpointError", "Origin", "Saved", "check_model", "find_usable", "is_checkpoint",
           "latest", "list_checkpoints", "load", "new_run_id", "read_manifest", "read_weights",
           "resolve", "root_of", "save", "sha256", "step_name", "verify", "write_weights",
           "TOKENIZER", "load_model", "tokenizer_file", "manifest_shape"]
