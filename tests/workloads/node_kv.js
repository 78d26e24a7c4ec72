// A key-value store over HTTP in Node.js: PUT /kv/KEY stores the request's body, GET /kv/KEY
// answers it, GET /count answers how many keys there are. Connections are kept alive as long
// as the client likes (no idle timeout). Usage: node node_kv.js PORT. Prints `ready` once it
// listens.
"use strict";
const http = require("http");

const store = new Map();
const server = http.createServer((req, res) => {
  const chunks = [];
  req.on("data", (chunk) => chunks.push(chunk));
  req.on("end", () => {
    const key = req.url.startsWith("/kv/") ? req.url.slice(4) : null;
    if (req.method === "PUT" && key) {
      store.set(key, Buffer.concat(chunks));
      res.writeHead(204).end();
    } else if (req.method === "GET" && key && store.has(key)) {
      const value = store.get(key);
      res.writeHead(200, { "Content-Length": value.length }).end(value);
    } else if (req.method === "GET" && req.url === "/count") {
      const body = String(store.size);
      res.writeHead(200, { "Content-Length": body.length }).end(body);
    } else {
      res.writeHead(404, { "Content-Length": 0 }).end();
    }
  });
});
server.keepAliveTimeout = 0;
server.requestTimeout = 0;
server.headersTimeout = 0;
server.listen(Number(process.argv[2]), "127.0.0.1", () => console.log("ready"));
