from qinfer.cli.main import main

main()
