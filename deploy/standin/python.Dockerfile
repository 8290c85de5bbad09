# Stand-in for python:3.11-slim (deploy/standin/build.sh): Debian 12's Python 3.11 with pip.
FROM metrale/debian-base:bookworm
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3 python3-pip python3-venv python-is-python3 \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED
# pip trusts the bundle the host trusts (copied into the base), not only its own certifi copy.
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1
CMD ["python3"]
