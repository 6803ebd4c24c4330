from kvtool.cli import main

main()
