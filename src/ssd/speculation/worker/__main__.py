from ssd.speculation.worker.serve import main

main()
