"""The layer above the four services, the only one that knows them all: the `turnrl` command
line (`cli`), the whole config file with every service's section (`project_config`), the
launcher of local service processes (`launcher`) and the client commands (`client_commands`).
The services and the shared core (`turnrl`) never import it."""
