# Stand-in for redis:7.4 (deploy/standin/build.sh): Debian 12's redis-server and redis-cli.
FROM metrale/debian-base:bookworm
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data
WORKDIR /data
VOLUME ["/data"]
EXPOSE 6379
CMD ["redis-server"]
