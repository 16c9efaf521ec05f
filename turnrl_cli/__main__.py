from turnrl_cli.cli import main

main()
