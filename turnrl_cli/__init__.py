"""The layer above the four services, the only one that knows them all: the `turnrl` command
line (`cli`), the whole config file with every service's section (`project_config`) and its
model paths resolved to the tiny demo model (`model_paths`), the local launcher's `up` and
`run` (`launcher`) over the child service processes (`processes`) and a run's progress display
(`progress`), and the client commands (`client_commands`). The services and the shared core
(`turnrl`) never import it."""
