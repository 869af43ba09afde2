"""The Trainer job of slurm_train.py, for the 2-node tests (`fittrain launch --nnodes 2`)."""

from slurm_train import main

if __name__ == "__main__":
    main()
