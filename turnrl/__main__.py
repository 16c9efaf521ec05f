from turnrl.cli import main

main()
