"""``python -m sparse_mla``: the ``sparse-mla`` command line, so that
``torchrun --nproc-per-node 2 -m sparse_mla bench --tp 2`` runs the distributed benchmark."""

from .cli import main

if __name__ == "__main__":
    main()
