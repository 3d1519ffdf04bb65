from specli.cli.app import main

main()
