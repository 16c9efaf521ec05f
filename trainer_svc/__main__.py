"""`python -m trainer_svc [--config F] [--host H] [--port N] [trainer.key=value ...]`: serves the trainer
service from the `trainer:` section of F (trainer_svc.server.main)."""

from trainer_svc.server import main

main()
