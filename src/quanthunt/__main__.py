from quanthunt.cli import main

main()
