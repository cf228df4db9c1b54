# Leasehold's coordinator in a container (docs/deploy.md, "A container").
#   docker build -t leasehold .
#   docker compose -f deploy/compose.yaml up -d      # with PostgreSQL and Caddy in front
# Not built on the machines this repository is tested on (no container runtime there): it is
# linted (`npx dockerfile-utils lint Dockerfile`, test/deploy-files.test.ts), and what it runs is
# what `npm ci --omit=dev` and `npm start` run everywhere else.

# Dependencies alone, so a code change does not reinstall them. The build stage runs as root
# (npm ci in /app); nothing of it but node_modules reaches the final image.
FROM node:20-bookworm-slim AS deps
WORKDIR /app
COPY package.json package-lock.json ./
COPY agent-client/package.json agent-client/
RUN npm ci --omit=dev && npm cache clean --force

FROM node:20-bookworm-slim
ENV NODE_ENV=production \
    LEASEHOLD_DATA_DIR=/var/lib/leasehold \
    LEASEHOLD_GRPC_ADDR=0.0.0.0:50051 \
    LEASEHOLD_HTTP_ADDR=0.0.0.0:8080 \
    LEASEHOLD_LOG_FORMAT=json
WORKDIR /app
COPY --from=deps /app/node_modules ./node_modules
COPY package.json package-lock.json ./
COPY agent-client/package.json agent-client/
# The coordinator shares the agent's wire writer (agent-client/src/wire.ts).
COPY agent-client/src agent-client/src
COPY gen gen
COPY server server
# The embedded PostgreSQL (no DATABASE_URL) keeps its data here; a volume keeps it across
# containers. The image's `node` user (uid 1000) runs everything.
RUN mkdir -p /var/lib/leasehold && chown node:node /var/lib/leasehold
VOLUME ["/var/lib/leasehold"]
USER node
EXPOSE 8080 50051
# /healthz answers 200 while the coordinator serves and its database answers (curl is not in the
# slim image; node is).
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["node", "-e", "fetch('http://127.0.0.1:8080/healthz').then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))"]
# Node itself is PID 1 (exec form, no shell, no npm): `docker stop`'s SIGTERM reaches the
# coordinator, which sends agents away (GoAway) and stops cleanly; docker stop -t 60 gives it time.
STOPSIGNAL SIGTERM
CMD ["node", "--import", "tsx", "server/cli.ts", "serve"]
