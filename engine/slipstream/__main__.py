from slipstream.cli.main import console

console()
