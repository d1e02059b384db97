# Shared by the bench scripts (sourced).

# wait_addr FILE TEXT: waits (30 s at most) until FILE holds TEXT, then prints what follows TEXT
# on its first such line (a server's "listening on" address).
wait_addr() {
  for _ in $(seq 300); do grep -q "$2" "$1" 2>/dev/null && break; sleep 0.1; done
  sed -n "s|.*$2||p" "$1" | head -1 | tr -d '[:space:]'
}
